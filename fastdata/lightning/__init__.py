"""The Lightning adapter: DataModules, epoch loader, runtime, options."""
