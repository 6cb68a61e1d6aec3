"""The version of fastdata: the writer stamps it into every manifest it writes."""

__version__ = "0.1.0"
