"""Why a DDP bucket cap the lane names did nothing: the texts ``trainers.engines`` writes under the engine's
``inactive`` and ``trainers.receipt`` compares when it judges a bucket-cap toggle inert. Torch-free, because the
receipt is built in the trial's process, which never imports torch."""

ONE_WORKER = "one worker: no DistributedDataParallel wrapper and no gradient all-reduce, so no bucket exists"
SINGLE_BUCKET = ("DDP's rebuilt buckets are one bucket holding every gradient: a cap only splits buckets, so it "
                 "split nothing and any cap at least this large runs the same reducer")
