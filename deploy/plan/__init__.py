"""The ratio planner: a worker profile, a discrete-event simulator driven by it, and the
search over producer/consumer/colocated splits (``pdserve plan``)."""
