"""circuits"""
