"""The one wire layer: the generated proto modules (gen/), proto <-> plain conversion
(convert.py), tensor packing (tensors.py) and the one table of errors, role errors and gRPC
statuses (errors.py). Above serving/ (it converts its plain types); below cluster/ and api/."""
