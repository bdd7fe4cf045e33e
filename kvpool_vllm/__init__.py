"""kvpool's connector for vLLM: memd as the KV store of a vLLM engine (`kvpool_vllm.connector.MemdConnector`).

Only `kvpool_vllm.connector` imports vLLM; the rest runs in kvpool's own venv too, where it is tested
against a real memd.
"""
