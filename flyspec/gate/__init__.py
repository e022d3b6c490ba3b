"""flyspec.gate"""
