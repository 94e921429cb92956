"""How a policy version travels: a manifest of safetensors shards in the blob store.

    publish.py       write a version (rank_publish.py: from every trainer rank, no gather)
    load.py          read and verify a version shard by shard;  stream_copy.py(.c): the swap's copy
    delta.py         sparse versions: only what changed since the previous one
    shards.py        safetensors written and read in place;  shard_hash.py: BLAKE3 per shard
    digest.py        StepCommitted.weights_sha256 (one process, or pieces from N ranks)

Imports bus/ and model/.
"""
