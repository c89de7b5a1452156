"""Modules generated from proto/sanctum/v1 by `make proto` (committed: no codegen at install).
Do not edit; edit the .proto files and rerun `make proto`."""
