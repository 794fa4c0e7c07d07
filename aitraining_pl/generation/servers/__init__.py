"""Generation servers: the trainer's client of each server (``replica``), the fleet that routes requests over
several and brings every weights version to each, the HF server and the launcher. Server mode speaks the
engine's own API (vLLM's ``vllm serve``; the HF server speaks the same routes)."""
