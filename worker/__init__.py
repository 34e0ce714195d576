"""Service plumbing shared by producer, consumer and colocated workers (docs/architecture.md):
the engine process and its loop, the ZMQ bridge to the gRPC process, the gRPC servicer,
and registration with the router. Role-specific logic lives in producer/ and consumer/."""
