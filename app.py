"""Streamlit entry of the workbench dashboard: navigation only; each page is one module in ui/.

    streamlit run app.py --server.fileWatcherType none --server.headless true

Long work (benchmarks, studies, training, GPU sampling) runs in background processes managed by ui/jobs.py; pages
start them and poll them, so a browser refresh never loses a running job.
"""
import sys

import streamlit as st

st.set_page_config(page_title="Speculative decoding workbench", page_icon=":material/speed:", layout="wide")
try:  # a local workbench: no "Deploy" button in the toolbar
    st.set_option("client.toolbarMode", "minimal")
except Exception:  # noqa: BLE001 - cosmetic only
    pass

PAGES = [
    # the default page is served only at "/" (its own url_path answers "Page not found"): "home" is never linked,
    # and the hidden aliases below make /start and /run open the Run page too
    st.Page("ui/run_page.py", title="Run", icon=":material/play_circle:", url_path="home", default=True),
    st.Page("ui/tune_page.py", title="Tune", icon=":material/tune:", url_path="tune"),
    st.Page("ui/results_page.py", title="Results", icon=":material/table_chart:", url_path="results"),
    st.Page("ui/serving_page.py", title="Serving", icon=":material/dns:", url_path="serving"),
    st.Page("ui/models_page.py", title="Models", icon=":material/neurology:", url_path="models"),
    st.Page("ui/gpu_page.py", title="GPU", icon=":material/memory:", url_path="gpu"),
    st.Page("ui/run_page.py", title="Run", icon=":material/play_circle:", url_path="start", visibility="hidden"),
    st.Page("ui/run_page.py", title="Run", icon=":material/play_circle:", url_path="run", visibility="hidden"),
]


def jobs_sidebar() -> None:
    from ui import jobs

    running = jobs.list_jobs(status=jobs.RUNNING)
    with st.sidebar:
        if running:
            st.caption(f"{len(running)} background job(s) running")
            for job in running[:8]:
                st.caption(f"· {job.kind}: {job.title}")
        else:
            st.caption("no background jobs running")


page = st.navigation(PAGES)
jobs_sidebar()
page.run()

if "torch" in sys.modules:  # a page imported torch after all: keep Streamlit's module watcher away from torch.classes
    import torch

    torch.classes.__path__ = []
