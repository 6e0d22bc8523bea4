"""chatmesh.gateway: the REST/SSE edge."""
