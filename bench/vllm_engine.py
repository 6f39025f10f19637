"""The vLLM engine process the benchmarks and tests drive: ``shared.kv.engines.vllm_server`` (the simulation's vLLM
pods run it too), under its old name."""

from shared.kv.engines.vllm_server import BLOCK_SIZE, ROOT, VLLM_PYTHON, EngineProcess, build_model, main, settle

__all__ = ["BLOCK_SIZE", "ROOT", "VLLM_PYTHON", "EngineProcess", "build_model", "main", "settle"]

if __name__ == "__main__":
    main()
