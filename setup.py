from setuptools import find_packages, setup

with open("requirements.txt") as f:
    requirements = [line.strip() for line in f if line.strip() and not line.startswith("#")]

setup(
    name="eagle-llm",
    version="3.0.0",
    description="Lossless speculative decoding with EAGLE draft heads (EAGLE-1, EAGLE-2, EAGLE-3)",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["eagle", "eagle.*"]),
    package_data={"eagle": ["default_head/*.json", "default_head/*.safetensors", "traineagle3/*.json"]},
    include_package_data=True,
    python_requires=">=3.10",
    install_requires=requirements,
    entry_points={"console_scripts": ["eagle=eagle.__main__:main"]},
)
