"""vLLM's paged KV cache as the agent's blocks, and the connector's state on both sides, without importing vLLM.

``shared.kv.engines.vllm`` (the ``KVConnectorBase_V1`` subclass vLLM loads) is a thin shell over this package: it
reads fields off vLLM's objects and calls in here, so everything that can be checked without a GPU is checked on
the CPU (``tests/test_kv_vllm_core.py``). One module per role:

* ``config``: ``kv_connector_extra_config`` (``ConnectorConfig``) and the session a request names (``session_of``);
* ``layout``: the ``KvLayout`` an engine computes in, read from vLLM's configuration, and what is refused;
* ``paged``: the paged layer tensors as agent blocks and back (``PagedLayout``, ``PagedCache``);
* ``plan``: what the scheduler tells the workers each step (``StepPlan`` and its specs), as bytes;
* ``scheduler``: the scheduler side's book (``SchedulerBook``) and what a checkpoint holds (``checkpoint_tokens``);
* ``worker``: the worker side (``WorkerBook``) and how it takes and restores sessions (``SessionPort``);
* ``loop``: the agent's asyncio loop beside vLLM's synchronous hooks (``AgentLoop``).

How a vLLM block maps to an agent block: vLLM keeps one paged tensor per attention layer. Its logical shape depends
on the attention backend: ``[2, num_blocks, block_size, kv_heads, head_dim]`` (FlashAttention), ``[num_blocks, 2,
block_size, kv_heads, head_dim]`` (FlashInfer, Triton) or either with heads before tokens (``HND``); since vLLM
0.32 a page ``[num_blocks, kv_heads, block_size, K|V content]`` whose interior is the backend's own (``paged``
learns the CPU backend's from its cache writer). vLLM block
``b`` of a request, across every layer, is one agent block ``[layers, 2, kv_heads, block_size, head_dim]``: agent
block ``i`` of a session is the session's ``i``-th vLLM block, so ``block_tokens`` is vLLM's ``block_size``.

Sessions: a request belongs to a session when its ``kv_transfer_params`` (the OpenAI API's ``kv_transfer_params``
field, or ``SamplingParams.extra_args["kv_transfer_params"]`` offline) carry ``{"gpuwarden_session": "<id>"}``;
``"gpuwarden_end": true`` on a request ends the session once it finishes (its checkpoints are retired). Each turn
of a conversation is one request whose prompt is the whole conversation so far. Requests without a session are
not touched.

What happens, step by step:

* Scheduler side (``SchedulerBook``): for a request of session S it offers the tokens a checkpoint holds. When this
  engine already holds S (an earlier turn ran here), the agent's host copy is the source and the prompt is checked
  against the tokens it holds (a rewritten conversation truncates the session where it differs). Otherwise the
  newest checkpoint in the store (through the checkpoint service when NATS is configured) is the source, and the
  prompt is trusted to continue the conversation: manifests carry no token ids. Only whole blocks are loaded, and
  never the prompt's last token (vLLM must compute at least one). Each step it tells the workers which blocks of
  which session became full (``CopySpec``), which to load (``LoadSpec``), which sessions to claim (``ClaimSpec``)
  and which requests finished (``FinishSpec``); a finished request's blocks are held until its worker copied them.
* Worker side (``WorkerBook``): copies each block of a session to host memory once, when it becomes full (vLLM
  never changes a full block), and the partial tail when the request finishes; the agent keeps those host copies as
  the session's blocks, so a drain, periodic or preStop save (the checkpoint service's commands through
  ``AgentEndpoint``) writes them to the store at any time, even after vLLM reused the GPU blocks. A load restores the
  session (verified chunk by chunk by the agent) and copies its blocks into the blocks vLLM allocated; blocks that
  could not be restored or failed verification are reported to vLLM, which recomputes them.

Not supported (refused at start): more than one KV cache group (hybrid or sliding-window models), MLA caches,
speculative decoding (it writes KV for tokens it may reject, so a full block could still change).
"""
