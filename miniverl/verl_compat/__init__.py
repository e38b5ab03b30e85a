"""verl v0.8.0 compatibility: its defaults, the rule of every miniverl field, the override grammar,
the run-time checks verl makes, the export and import of launches, the loss conformance checks."""
