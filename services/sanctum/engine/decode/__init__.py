"""The decode loop and its policies: sequences, the Decoder's round, shared rounds of several
sequences, sampling and acceptance, the drafter as a peer. Knows the model pieces (model/) and
nothing of scheduling, Ray or gRPC."""
