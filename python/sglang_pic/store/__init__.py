"""PTStore: a distributed prefix tensor store, SGLang's HiCache L3 tier (the PTStore design).

``engine`` (owned/replica caches with GDSF, ``gdsf``; the SSD tier, ``ssd``; object metadata),
``protocol`` (the wire format), ``auth`` (CurveZMQ keys from tokens, tenants), ``server`` and
``client`` (consistent hashing, batched RPCs), ``shm`` (the same-node data path),
``hicache_backend`` (HiCache's ``dynamic`` backend) and ``cli`` (``sglang-pic store``).
"""
