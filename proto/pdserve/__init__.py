"""pdserve protocol packages (generated code under v1/)."""
