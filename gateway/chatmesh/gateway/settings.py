"""Settings of the REST/SSE edge. The bind address and port are shared ones (`chatmesh.mesh.settings`)."""

from __future__ import annotations

from chatmesh.mesh.config import Setting, parse_bool


def _hosts(text: str) -> tuple[str, ...]:
    return tuple(h.strip().lower() for h in text.split(",") if h.strip())


AUTH = Setting("CHATMESH_AUTH", "local",
               "edge identity: `local` serves one local user on loopback (bearer keys still honoured); "
               "`required` demands an API key or a browser session", str, choices=("local", "required"))
LOCAL_USER = Setting("CHATMESH_LOCAL_USER", "local", "user id of the development identity (CHATMESH_AUTH=local)", str)
AUTH_DATABASE_URL = Setting("CHATMESH_AUTH_DATABASE_URL", "",
                            "database of the gateway's auth_ tables (default: CHATMESH_DATABASE_URL, "
                            "else <CHATMESH_DATA_DIR>/chatmesh.db)", str)
SESSION_TTL_S = Setting("CHATMESH_SESSION_TTL_S", 7 * 24 * 3600, "lifetime of a browser session, seconds", int)
SERVER = Setting("CHATMESH_GATEWAY_SERVER", "uvicorn",
                 "HTTP server of the gateway: uvicorn (HTTP/1.1) or hypercorn (HTTP/2 over TLS via ALPN, and "
                 "HTTP/1.1)", str, choices=("uvicorn", "hypercorn"))
TLS_CERT = Setting("CHATMESH_TLS_CERT", "", "PEM certificate chain for HTTPS at the edge (with CHATMESH_TLS_KEY)", str)
TLS_KEY = Setting("CHATMESH_TLS_KEY", "", "PEM private key for HTTPS at the edge", str)
REDIS_URL = Setting("CHATMESH_REDIS_URL", "",
                    "Redis holding the per-user limits shared by gateway processes (empty: in memory)", str)
TURNS_PER_MINUTE = Setting("CHATMESH_LIMIT_TURNS_PER_MINUTE", 20, "per-user turns per minute (token bucket)", int)
OPEN_STREAMS = Setting("CHATMESH_LIMIT_OPEN_STREAMS", 4, "per-user concurrently open turn streams", int)
PROMPT_TOKENS_PER_HOUR = Setting("CHATMESH_LIMIT_PROMPT_TOKENS_PER_HOUR", 1_000_000,
                                 "per-user prompt tokens per hour (token bucket; reserved before each turn, "
                                 "settled to the prompt's true size, never refunded for a stopped turn)", int)
LIMIT_UNAUTHENTICATED_PER_MINUTE = Setting(
    "CHATMESH_LIMIT_UNAUTHENTICATED_PER_MINUTE", 60,
    "per client address: requests that fail authentication, and login attempts, per minute (token bucket; 429 "
    "over it)", int)
FORWARDED_ALLOW_IPS = Setting(
    "CHATMESH_FORWARDED_ALLOW_IPS", "",
    "comma-separated addresses or networks (10.0.0.0/8) of the proxies in front of the gateway whose "
    "X-Forwarded-For and X-Forwarded-Proto are believed (empty: none; the TCP peer is the client's address)", str)
HEARTBEAT_S = Setting("CHATMESH_SSE_HEARTBEAT_S", 15.0, "seconds of model silence before an SSE heartbeat", float)
LINK_ALLOWLIST: Setting[tuple[str, ...]] = Setting("CHATMESH_LINK_ALLOWLIST", (),
                         "comma-separated hosts whose links survive output sanitising (subdomains included)", _hosts)
MAX_BODY_BYTES = Setting("CHATMESH_MAX_BODY_BYTES", 4 * 1024 * 1024,
                         "largest request body the edge accepts (413 above it): a largest message "
                         "(CHATMESH_MAX_MESSAGE_BYTES) plus JSON escaping", int)
CHAT_ADDRESSES = Setting(
    "CHATMESH_CHAT_ADDRESSES", "",
    "ChatService addresses the gateway spreads turns over, round robin, and fails over between: IP:port, "
    "comma-separated, or a gRPC target such as dns:///chat.internal:50051 (every address of the name); "
    "empty: CHATMESH_CHAT_ADDRESS", str)
CHAT_DEADLINE_S = Setting("CHATMESH_GATEWAY_RPC_DEADLINE_S", 10.0, "deadline of the edge's unary ChatService calls",
                          float)
SECURE_COOKIES = Setting("CHATMESH_SECURE_COOKIES", False,
                         "mark session cookies Secure even without TLS at the edge (TLS behind a proxy)", parse_bool)
HEADER_TIMEOUT_S = Setting("CHATMESH_EDGE_HEADER_TIMEOUT_S", 10.0,
                           "a request's headers must be complete this long after its connection opened (or its "
                           "first byte on a kept-alive connection), else 408 and the connection closed", float)
BODY_TIMEOUT_S = Setting("CHATMESH_EDGE_BODY_TIMEOUT_S", 30.0,
                         "a request's body must be complete this long after its headers, else 408", float)
IDLE_TIMEOUT_S = Setting("CHATMESH_EDGE_IDLE_TIMEOUT_S", 5.0,
                         "a kept-alive connection with no request in flight is closed after this long", float)
PUBLIC_ORIGIN = Setting("CHATMESH_PUBLIC_ORIGIN", "",
                        "the edge's public origin (https://chat.example.com) that redirects are built from; "
                        "empty: redirects carry only the path (never the request's Host header)", str)
KEY_PEPPER = Setting("CHATMESH_KEY_PEPPER", "chatmesh-dev-pepper",
                     "secret keying the stored digests of API keys and session tokens, and signing device cookies "
                     "(set a secret in production: a gateway refuses this default on a non-loopback address, and on any address "
                     "when configured to serve the public: a public origin, secure cookies, TLS, trusted proxies)", str)
AUTH_CACHE_S = Setting("CHATMESH_AUTH_CACHE_S", 0.5,
                       "seconds a key or session lookup is cached per gateway: a revoked key or ended session stops "
                       "working everywhere within this bound", float)
OPENAI_MODEL = Setting("CHATMESH_OPENAI_MODEL", "",
                       "override of the model id the OpenAI-compatible surface (/openai/v1) lists under /models and "
                       "accepts in requests (empty: the model profile's id, from CHATMESH_MODEL)", str)
