"""The serving core: requests and their errors, the verifier's request lifecycle, the scheduler
(one thread owns MLX), the inline backend and its stats. Ray-free, gRPC-free and protobuf-free:
plain types in and out. Built on engine/, cache/, settings.py and tokenizer.py; everything that
serves (inline, the cluster's actors, the front end) runs it."""
