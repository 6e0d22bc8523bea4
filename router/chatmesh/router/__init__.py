"""chatmesh.router: RouteService, consistent hashing with bounded loads."""
