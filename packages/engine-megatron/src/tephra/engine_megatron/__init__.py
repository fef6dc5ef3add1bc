"""tephra.engine_megatron: the engine contract on megatron-core (TP, SP, PP, EP, CP, DP).

Import the engine lazily (`tephra.engine_megatron.engine.MegatronEngine`, or by name through
`tephra.engine_api.get_engine("megatron", config)`): importing megatron takes seconds.
"""
