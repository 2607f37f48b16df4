"""The model: a Llama-family decoder over the paged pool (`decoder.py`, `linear.py`), its
attention backends (`attention.py`: torch, Triton, flash-attn), loading from Hugging Face
directories, GGUF files and hub ids (`loader.py`), the bundled default model
(`default_model/`, made by `train_default_model.py`), random models for tests
(`random_model.py`) and the models `symphony models` lists (`catalog.py`)."""
