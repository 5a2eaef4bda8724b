"""PTStore: a distributed prefix tensor store as SGLang's HiCache L3 tier (seed 004). Work in
progress: ``engine`` (one server's owned/replica caches, GDSF, SSD tier, flat object metadata)
exists; the zmq server/client, consistent hashing and the HiCache ``dynamic`` backend are next.
"""
