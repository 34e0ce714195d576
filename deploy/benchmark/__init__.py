"""`pdserve bench`: a serving benchmark for pdserve clusters (gRPC or OpenAI HTTP).

Metrics follow the definitions of ``vllm bench serve`` so that numbers are comparable:
see ``metrics.py``. One noun per module: workload, record, metrics, backends, load,
progress, report, plots, clusters, sweep.
"""
