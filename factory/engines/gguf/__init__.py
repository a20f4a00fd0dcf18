"""GGUF through llama.cpp (see engine.py; llama.py pins and builds llama.cpp)."""
