"""``gpuwarden agent final-save``: an inference pod's preStop hook, ``shared.kv.prestop``'s final save (what
``gpuwarden-kv-prestop`` does where the agent is installed alone), with the mesh found as every command finds it."""

from __future__ import annotations

import argparse
import asyncio

from shared.console.state import NATS_ONLY, UsageError, command_env
from shared.contract.checkpoint import SaveSessionsReport
from shared.contract.registry import codec


def cmd_agent_final_save(args: argparse.Namespace) -> int:
    """The preStop hook of an inference pod: ask the pod's KV agent to save everything, wait for the report."""
    from shared.kv.prestop import final_save, prestop_command

    env = command_env(NATS_ONLY)
    try:
        command = prestop_command(args.pod, args.deadline)
    except ValueError as exc:
        raise UsageError(f"agent final-save: {exc}") from None
    reply = asyncio.run(final_save(command, env))
    print(codec.encode(reply).decode())
    return 0 if isinstance(reply, SaveSessionsReport) and not reply.failed else 1
