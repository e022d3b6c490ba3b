"""flyspec.bench"""
