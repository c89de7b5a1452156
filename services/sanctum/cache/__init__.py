"""The prompt cache: a radix tree of saved entries, LRU by bytes, persisted on disk, with the
ladder policy (where recurrent-state rungs go). Next to the engine on the ground floor: it
imports neither the engine (it is handed the target) nor Ray, gRPC or protobuf."""
