"""Settings shared by every service: addresses, data folder, logging, shutdown."""

from __future__ import annotations

from chatmesh.mesh.config import Setting, parse_bool

HOST = Setting("CHATMESH_HOST", "127.0.0.1", "address the gateway binds; loopback unless auth is configured", str)
GATEWAY_PORT = Setting("CHATMESH_GATEWAY_PORT", 8080, "HTTP port of the gateway", int)
CHAT_ADDRESS = Setting("CHATMESH_CHAT_ADDRESS", "127.0.0.1:50051", "gRPC address of ChatService", str)
STORE_ADDRESS = Setting("CHATMESH_STORE_ADDRESS", "127.0.0.1:50052", "gRPC address of StoreService", str)
ROUTER_ADDRESS = Setting("CHATMESH_ROUTER_ADDRESS", "127.0.0.1:50053", "gRPC address of RouteService", str)
ENGINE_ADDRESS = Setting("CHATMESH_ENGINE_ADDRESS", "127.0.0.1:50054",
                         "gRPC address of the (first) GenerateService replica", str)
MODERATION_ADDRESS = Setting("CHATMESH_MODERATION_ADDRESS", "127.0.0.1:50055",
                             "gRPC address of ModerateService", str)
OWNER_TOKEN_ADDRESS = Setting("CHATMESH_OWNER_TOKEN_ADDRESS", "127.0.0.1:50056",
                              "gRPC address of the gateway's OwnerTokenService, where internal clients acting for "
                              "users (spiffe://chatmesh/client/*) get owner tokens, mutual TLS only (empty: off)", str)
LISTEN = Setting("CHATMESH_LISTEN", "", "address `chatmesh serve` binds (default: the service's own address)", str)
DATA_DIR = Setting("CHATMESH_DATA_DIR", ".data", "folder for the embedded SQLite database and caches", str)
LOG_LEVEL = Setting("CHATMESH_LOG_LEVEL", "info", "log level", str,
                    choices=("debug", "info", "warning", "error"))
LOG_JSON = Setting("CHATMESH_LOG_JSON", True, "JSON log lines (false: human-readable)", parse_bool)
SHUTDOWN_GRACE_S = Setting("CHATMESH_SHUTDOWN_GRACE_S", 5.0,
                           "seconds open streams get to finish on SIGTERM before they are cancelled", float)

# One metrics port per service (chatmesh.mesh.metrics serves GET /metrics there, on the interface the service
# listens on); the defaults mirror the gRPC ports (50051 -> 9151, ...) and the gateway's 8080 -> 9180.
METRIC_PORTS: dict[str, Setting[int]] = {
    "gateway": Setting("CHATMESH_GATEWAY_METRICS_PORT", 9180, "HTTP port of the gateway's Prometheus /metrics (0: off)",
                       int),
    "chat": Setting("CHATMESH_CHAT_METRICS_PORT", 9151, "HTTP port of ChatService's Prometheus /metrics (0: off)", int),
    "store": Setting("CHATMESH_STORE_METRICS_PORT", 9152, "HTTP port of StoreService's Prometheus /metrics (0: off)",
                     int),
    "router": Setting("CHATMESH_ROUTER_METRICS_PORT", 9153, "HTTP port of RouteService's Prometheus /metrics (0: off)",
                      int),
    "engine": Setting("CHATMESH_ENGINE_METRICS_PORT", 9154,
                      "HTTP port of this engine replica's Prometheus /metrics (0: off)", int),
    "moderation": Setting("CHATMESH_MODERATION_METRICS_PORT", 9155,
                          "HTTP port of ModerateService's Prometheus /metrics (0: off)", int),
}

# Trust inside the mesh (trust.py): mutual TLS with SPIFFE identities, per-RPC authorization, owner tokens.
MESH_CA_FILE = Setting("CHATMESH_MESH_CA_FILE", "",
                       "PEM bundle of the CAs whose certificates the mesh trusts (empty: <CHATMESH_DATA_DIR>/certs/"
                       "ca.pem); reloaded when it changes", str)
MESH_CERT_FILE = Setting("CHATMESH_MESH_CERT_FILE", "",
                         "this process's PEM certificate chain, naming its identity spiffe://chatmesh/<service> as a "
                         "URI SAN (and <service>.chatmesh as a DNS SAN for a server) (empty: <CHATMESH_DATA_DIR>/"
                         "certs/<service>.pem); reloaded when it changes", str)
MESH_KEY_FILE = Setting("CHATMESH_MESH_KEY_FILE", "",
                        "PEM private key of CHATMESH_MESH_CERT_FILE (empty: <CHATMESH_DATA_DIR>/certs/<service>-key."
                        "pem); reloaded when it changes", str)
MESH_PLAINTEXT = Setting("CHATMESH_MESH_PLAINTEXT", False,
                         "true: gRPC without TLS, identities or owner tokens (loopback only: a service refuses to "
                         "listen on or dial any other address in plaintext)", parse_bool)
MESH_AUTHZ_FILE = Setting("CHATMESH_MESH_AUTHZ_FILE", "",
                          "JSON file overriding authorization rules, {\"/chatmesh.v1.Service/Rpc\": [identity, ...]} "
                          "(patterns: spiffe://chatmesh/client/* and * for any peer); read at start-up", str)
HEALTH_PORT = Setting("CHATMESH_HEALTH_PORT", 0,
                      "plaintext port serving grpc.health.v1 only, for probes without a client certificate, on the "
                      "service's listen host (0: off)", int)
OWNER_TOKEN_KEYS_FILE = Setting("CHATMESH_OWNER_TOKEN_KEYS_FILE", "",
                                "JSON key set of owner tokens (Ed25519; the gateway's copy holds private keys, "
                                "verifiers' only public ones) (empty: <CHATMESH_DATA_DIR>/gateway/owner-token-keys.json "
                                "for the gateway, <CHATMESH_DATA_DIR>/certs/owner-token-public-keys.json for the "
                                "others); reloaded when it changes", str)
OWNER_TOKEN_TTL_S = Setting("CHATMESH_OWNER_TOKEN_TTL_S", 900,
                            "lifetime of the owner tokens the gateway mints, seconds (longer than the longest turn: "
                            "a turn's last store write carries the token its request came with); every verifier "
                            "refuses a token that lives longer, so set it alike on every process", int)

# The message size policy (chatmesh.mesh.message_size), shared by the gateway, chat, moderation and the store.
MAX_MESSAGE_TOKENS = Setting("CHATMESH_MAX_MESSAGE_TOKENS", 128_000,
                             "longest message in tokens (a pasted document), where the model's input room allows",
                             int)
MAX_MESSAGE_BYTES = Setting("CHATMESH_MAX_MESSAGE_BYTES", 1024 * 1024,
                            "largest message in UTF-8 bytes, checked before tokens are counted (user messages and "
                            "replies, at every hop)", int)
