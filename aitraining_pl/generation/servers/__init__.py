"""Generation servers: the fleet (``fleet``: one server or N, a single server a fleet of one) that routes requests
over its servers' clients (``replica``, ``http``) and brings every weights version to each; auth (tokens, token
files, the loopback check), the HF server and the launcher. Server mode speaks the engine's own API (vLLM's ``vllm
serve``; the HF server speaks the same routes)."""
