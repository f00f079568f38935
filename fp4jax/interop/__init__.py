"""Other tools' model formats: hf_llama.py (Hugging Face `LlamaForCausalLM` directories, safetensors)."""

__all__: list[str] = []  # the submodules are the API
