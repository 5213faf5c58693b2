"""The models every stage passes on: what a user asks for, what pvisor and pvisor-host report, and what
crosses the backend seam. All are pydantic models; none of them knows about Docker."""
