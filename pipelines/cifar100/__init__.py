"""CIFAR-100 end to end: shard the archive once, train a narrow ResNet with the fastdata presets.

One machine, one process (CPU or one GPU)::

    python -m pipelines.cifar100 --data ../shared/data/cifar-100-python.tar.gz  # 300 s budget
    python -m pipelines.cifar100 --data ../shared/data/cifar-100-python.tar.gz --budget 600
    python -m pipelines.cifar100 --data ../shared/data/cifar-100-python.tar.gz --epochs 4
    fastdata train cifar100 --download --out runs/c100      # the same, from the fastdata CLI
    python -m pipelines.cifar100 --out runs/c100 --resume    # continue a killed run mid-epoch

What it does: OUT/shards is written from the archive the first time (reused after); a
`ShardDataModule(train_transforms="cifar")` feeds uint8 batches (random crop + flip on the device); the
model is `pipelines.cifar100.model` (``--model resnet9 | resnet18``, ``--width``), trained by
`fastdata.train.make_trainer` (precision "auto", OUT/checkpoints/last.ckpt every
``--checkpoint-every`` steps). It prints one row per epoch (train loss, test top-1, img/s,
data-wait %) and writes OUT/metrics.json; Lightning's CSV logs go to OUT/logs.

Run length: ``--budget SECONDS`` (default 300) is wall time from the command's start, sharding
and evaluation included. The run times its first steps, plans the steps that fit (one
evaluation per epoch end, the last epoch possibly partial) and draws the one-cycle LR schedule
over them; it re-plans every 50 steps and at each epoch end, so a slower (or faster) spell
moves the end and the LR decay with it (`pipelines.cifar100.budget`). The plan is printed once,
the table adds planned epochs, seconds per evaluation and seconds left, and metrics.json holds
every plan under "budget". A resumed run (``--resume``) gets the budget afresh from its own
start. ``--epochs N`` trains exactly N epochs instead.

Several GPUs on one machine: Lightning's own launcher starts one process per device::

    python -m pipelines.cifar100 --devices 4

or let torchrun start them (Lightning reads its environment variables)::

    torchrun --standalone --nproc_per_node=4 -m pipelines.cifar100 --devices 4

Several machines with torchrun (run on every node; NODE_RANK 0..N-1, MASTER = node 0's address)::

    torchrun --nnodes=2 --node_rank=$NODE_RANK --nproc_per_node=4 \\
        --master_addr=$MASTER --master_port=29500 -m pipelines.cifar100 --devices 4 --num-nodes 2

SLURM (one task per GPU; Lightning's SLURMEnvironment reads the srun variables)::

    #!/bin/bash
    #SBATCH --nodes=2
    #SBATCH --ntasks-per-node=4
    #SBATCH --gpus-per-node=4
    #SBATCH --cpus-per-task=8
    srun python -m pipelines.cifar100 --devices 4 --num-nodes 2 --out /shared/runs/c100

``--devices`` and ``--num-nodes`` must match what the launcher started. With several processes,
global rank 0 writes the shards and the others wait for its manifest, so ``--out`` must be on a
file system every node sees (or shard beforehand with ``fastdata shard cifar100 ARCHIVE OUT/shards``).
``--batch-size`` is per device; the epoch is split into equal per-rank spans, so one epoch takes
1/world_size of the steps. On CPU, ``--devices 2`` runs two processes over gloo (a test setup:
on 2 cores it is slower than one process).
"""
