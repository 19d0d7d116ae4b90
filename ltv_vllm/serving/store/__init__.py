"""Task files, in whichever process reads or writes them (no vLLM import at load): the task
store and a store many replicas share, a vector as a PEFT adapter, compile requests and the
compile worker's process, the self-check's probe files and verdicts, and the vectors an
engine or the API server reads by a store task's key."""
