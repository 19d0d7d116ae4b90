"""Job processes of ours (`jobs`: `python -m MODULE JOB OUT`, forked from a forkserver that
imported vLLM once): `vllm.LLM` engines with task vectors (`llm`), hidden states captured on
vLLM's pooling runner (`capture`) and the self-check runner (`selfcheck`); their callers run
in the user's or the launcher's process."""
