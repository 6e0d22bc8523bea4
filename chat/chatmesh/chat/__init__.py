"""chatmesh.chat: ChatService, the turn lifecycle (see core.py for its modules, chatmesh.mesh.turn for its states)."""
