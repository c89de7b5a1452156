"""The gRPC front end: the servicers, the guard (token, TLS, strict parsing), the Python client
and `sanctum serve`, over a backend (serving/inline.py or cluster/backend.py)."""
