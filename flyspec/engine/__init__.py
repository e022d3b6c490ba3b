"""flyspec.engine"""
