"""flyspec.server"""
