"""verl compatibility, for verl 0.8.0 and 0.9.1 (versions.py): their defaults, the rule of every
miniverl field, the override grammar, the run-time checks verl makes, the export and import of
launches, the loss conformance checks."""
