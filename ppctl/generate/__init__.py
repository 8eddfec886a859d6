"""``ppctl generate``: text from a trained run or a Hugging Face model folder, in one process.

``source.py`` builds the whole model as one chunk (a run's latest checkpoint, or a Hugging Face folder
through ``model.init_from``) with its tokenizer; ``sampling.py`` picks each next token (greedy, or sampled
with temperature, top-k and top-p from a seeded generator); ``decode.py`` runs the prompt and then one token
a step through the chunk's KV cache (``DecoderChunk.generate_step``) and turns the ids into text as they come.
"""
