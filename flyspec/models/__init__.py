"""flyspec.models"""
