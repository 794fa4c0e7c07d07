"""A server speaking the protocol of Thinking Machines' ``tinker`` client on this project's models
(``aitraining-pl tinker-serve``; docs/tinker.md). Needs ``tinker`` (its protobuf module), fastapi and uvicorn."""
