"""Inference after pretraining: a key/value cache (:mod:`.kv_cache`), token sampling
(:mod:`.sampling`) and the generation loop (:mod:`.generation`)."""
