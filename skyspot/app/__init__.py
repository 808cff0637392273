"""One use-case per module (launch, status, preflight): the layer that picks an executor.

Called by the CLI; calls executors, task, planning, pricing and the contracts (docs/architecture.md).
"""
