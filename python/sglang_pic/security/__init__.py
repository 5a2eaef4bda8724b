"""What stands between a client and SGLang, and keeps secrets out of sight.

- ``api_key``: the key every request needs (where it comes from, how it is checked);
- ``secret_files``: reading and writing key files only their owner can read;
- ``redaction``: secrets kept out of logs, ``/get_server_info`` and crash dumps;
- ``request_validation``: whole generation requests checked before SGLang reads them.

The HTTP front door (bounds on sizes, connections and time; strict schemas) is ``frontdoor``.
"""
