"""Streamlit dashboard: one module per page (thin), plus job management and shared helpers."""
