"""ChatService settings: system prompts, generation defaults, context limits, leases."""

from __future__ import annotations

from chatmesh.mesh.config import Setting

SYSTEM_PROMPTS = Setting(
    "CHATMESH_SYSTEM_PROMPTS", "",
    "JSON file mapping system-prompt versions to text (empty: the built-in v1)", str)
SYSTEM_PROMPT_VERSION = Setting(
    "CHATMESH_SYSTEM_PROMPT_VERSION", "v1", "system-prompt version new conversations start with", str)
MAX_REPLY_TOKENS = Setting("CHATMESH_MAX_REPLY_TOKENS", 256, "cap on tokens generated per reply", int)
TEMPERATURE = Setting("CHATMESH_TEMPERATURE", 0.0, "sampling temperature (0: greedy)", float)
TOP_P = Setting("CHATMESH_TOP_P", 1.0, "nucleus sampling mass", float)
CONTEXT_TOKENS = Setting(
    "CHATMESH_CONTEXT_TOKENS", 8192,
    "cap on the context window in tokens: prompt plus reply must fit the served model's context length (the "
    "CHATMESH_MODEL profile's: SmolLM2 8192, Llama 3.1 131072) and this", int)
PROMPT_CAP_TOKENS = Setting(
    "CHATMESH_PROMPT_CAP_TOKENS", 131072,
    "configured cap on prompt tokens (pasted input up to 128k where the model allows)", int)
SUMMARY_THRESHOLD_TOKENS = Setting(
    "CHATMESH_SUMMARY_THRESHOLD_TOKENS", 0,
    "history tokens past which older turns are summarised at a turn boundary (0: derived from the served model: "
    "12000, or half the prompt room, the context less the reply budget, when that is less; above the room is "
    "refused at start-up)", int)
KEEP_RECENT_MESSAGES = Setting(
    "CHATMESH_KEEP_RECENT_MESSAGES", 6, "messages kept verbatim after a summary", int)
# A dead chat process's turns are taken over by a retry once their lease lapses: at most the TTL after its last
# renewal. 1.5 s with a renewal every 250 ms survives five missed renewals (a store stall of ~1.25 s) and costs
# one single-row UPDATE per generating turn per 250 ms (BENCHMARKS.md, bench/faults.py heartbeat).
LEASE_TTL_MS = Setting(
    "CHATMESH_TURN_LEASE_TTL_MS", 1500,
    "turn lease length; a chat process that dies mid-turn frees the turn id after this", int)
PROGRESS_INTERVAL_MS = Setting(
    "CHATMESH_TURN_PROGRESS_INTERVAL_MS", 250,
    "how often a generating turn writes its reply so far and renews its lease (for attach from other processes)",
    int)
INSTANCE_ID = Setting(
    "CHATMESH_CHAT_INSTANCE_ID", "",
    "this chat process's name, recorded as lease holder (empty: chat-<host>-<pid>)", str)
ADVERTISE_ADDRESS = Setting(
    "CHATMESH_CHAT_ADVERTISE_ADDRESS", "",
    "address other chat processes reach this one at, to forward a stop to the process generating the turn "
    "(empty: the listen address)", str)
ENGINE_DEADLINE_S = Setting(
    "CHATMESH_ENGINE_DEADLINE_S", 300.0, "deadline of one engine generation", float)
# A router restart (or one chat has not reconnected to yet) is absorbed by the turn: its pick waits this long for
# the router's channel and for a replica, then fails the turn, retryable (clients.GrpcRouter; BENCHMARKS.md,
# issue 18: the client's retry backoff otherwise adds up to 1.5 s to each turn caught by the restart).
ROUTER_WAIT_MS = Setting(
    "CHATMESH_CHAT_ROUTER_WAIT_MS", 1500,
    "how long a turn's replica pick waits for the router (restarting, reconnecting, no replica serving yet) "
    "before the turn fails, retryable", int)
