"""ModerateService settings: the policy, deadlines and the failure policy of each direction. (The size of what
it accepts is the message size policy's, CHATMESH_MAX_MESSAGE_BYTES.)"""

from __future__ import annotations

from chatmesh.mesh.config import Setting, parse_bool

FAILURE_MODES = ("closed", "open")

POLICY_FILE = Setting("CHATMESH_MODERATION_POLICY_FILE", "",
                      "moderation policy JSON (categories, rules, thresholds); empty: the built-in default", str)
CHECK_DEADLINE_MS = Setting("CHATMESH_MODERATION_CHECK_DEADLINE_MS", 50.0,
                            "the service's time limit for one check (per 32 KiB of a long input); past it the "
                            "direction's failure policy decides",
                            float)
CLIENT_TIMEOUT_MS = Setting("CHATMESH_MODERATION_CLIENT_TIMEOUT_MS", 250.0,
                            "how long a moderation client waits for a verdict before its failure policy decides",
                            float)
CLIENT_CONNECT_WAIT_MS = Setting("CHATMESH_MODERATION_CLIENT_CONNECT_WAIT_MS", 1500.0,
                                 "how long a moderation client's input check waits for the service to be reachable "
                                 "(restarting, reconnecting) before the input failure policy decides", float)
INPUT_FAILURE = Setting("CHATMESH_MODERATION_INPUT_FAILURE", "closed",
                        "when the input check cannot finish: closed blocks the message, open lets it through", str,
                        choices=FAILURE_MODES)
OUTPUT_FAILURE = Setting("CHATMESH_MODERATION_OUTPUT_FAILURE", "open",
                         "when an output check cannot finish: closed stops the reply, open lets the chunk through", str,
                         choices=FAILURE_MODES)
CHECK_THREAD = Setting("CHATMESH_MODERATION_CHECK_THREAD", False,
                       "run checks on a worker thread (for backends that wait, such as a guard model) instead of "
                       "inline on the event loop with load shedding past the deadline", parse_bool)
GUARD_ADDRESS = Setting("CHATMESH_MODERATION_GUARD_ADDRESS", "",
                        "Triton gRPC address of a guard model (policy categories with model guard:<label>); "
                        "empty: none", str)
GUARD_MODEL = Setting("CHATMESH_MODERATION_GUARD_MODEL", "chatmesh_guard", "name of the guard model on Triton", str)
CLIENT_BATCH_MS = Setting("CHATMESH_MODERATION_CLIENT_BATCH_MS", 1.0,
                          "how long a moderation client holds an output chunk so other streams' chunks share its "
                          "message (0: only those of the same event-loop turn)", float)
