"""flyspec.spec_decode"""
