"""What unit tests share that is not a fixture or a fake: plain modules, never test modules."""
