"""The Hugging Face side of sampling, beside the backend that uses it: ``generation.hf.backend.HFBackend`` (the
policy samples itself), the KV-cache decoder (``decoding``), its multi-turn episode form (``episode_decoding``) and
its vision-language form (``vision_decoding``), and the one ``generate`` call with its settings (``generate``)."""
