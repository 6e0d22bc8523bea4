"""Generated from protos/chatmesh/v1 by `./dev gen`. Do not edit."""
